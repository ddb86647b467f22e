"""Accuracy of the engine across KV dtypes: perplexity/KL/top-1 on an embedded corpus,
long-context retrieval and head-of-document recall, with a regression gate."""
