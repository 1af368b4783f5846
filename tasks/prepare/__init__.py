"""The prepare flow's data stages, one module each (clean to lexicon), their readers, the input check and the sample."""
