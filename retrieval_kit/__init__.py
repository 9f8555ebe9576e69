"""retrieval_kit: a thin functional kit to fine-tune embedding models and rerankers."""

__version__ = "0.1.0"
