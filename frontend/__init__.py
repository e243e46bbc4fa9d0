"""The headwater frontend: OpenAI-compatible HTTP in, request plane out.

The pipeline's stages have one name each, in code, metrics and logs alike:
``preprocess`` (template + tokenizer pool) → ``route`` (router) → ``plane`` (request
plane to a worker) → ``postprocess`` (detokenizer + stop strings).
"""
