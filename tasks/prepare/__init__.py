"""The prepare flow's data stages, one module each (clean to lexicon), their readers and matcher, and the featuriser."""
