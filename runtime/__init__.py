"""k4's engine: GGUF models, tokenizer, chat templates, the numpy reference and CUDA backends."""

__version__ = "0.1.0"
