"""Tokenization, for every process that turns text into token ids and back (API processes, the
engine): the base model's tokenizer and chat template, adapters' own tokenizers, incremental
detokenization with stop strings. No model code: an API process imports it without the runner."""
