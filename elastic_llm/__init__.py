"""elastic-llm: elastic pipeline-parallel LLM pretraining on Ray."""

__version__ = "0.1.0"
