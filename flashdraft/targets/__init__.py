"""Engines that run the target besides torch (flashdraft/target.py): llama.cpp (`--backend llama`)."""
