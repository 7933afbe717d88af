"""Corpus, tokenizer, shards and the loader that reads them."""
