"""CapyCTL: runs more LLMs than a GPU machine can hold, behind one OpenAI-compatible endpoint."""

__version__ = "0.1.0"
