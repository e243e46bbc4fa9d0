"""The preprocess stage: chat template, then tokenization off the event loop."""
