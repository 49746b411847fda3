"""flashdraft: DFlash speculative decoding for local LLMs (engine, server, training, bench)."""

__version__ = "0.1.0"
