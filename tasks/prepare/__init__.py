"""Data stages of the prepare flow, one module each (clean, numbers, vocab, embeddings, trie, lexicon), and helpers."""
