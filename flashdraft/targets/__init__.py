"""Engines that run the target: torch (the reference, :mod:`flashdraft.targets.torch`) and llama.cpp (`--backend llama`)."""


def target_backend(target: object) -> str:
    """The engine that runs ``target``: ``"llama"`` for :class:`~flashdraft.targets.llama.LlamaTarget`
    (its class attribute), ``"torch"`` for :class:`flashdraft.targets.torch.Target` and anything else
    without a ``backend`` attribute (test doubles)."""
    return getattr(target, "backend", "torch")
