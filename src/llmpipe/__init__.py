"""llmpipe: a declarative LLM training pipeline (data → tokenizer → pretrain → SFT → DPO → evaluation)."""

__version__ = "0.1.0"
