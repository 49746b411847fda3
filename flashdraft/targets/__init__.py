"""Engines that run the target besides torch (flashdraft/target.py): llama.cpp (`--backend llama`)."""


def target_backend(target: object) -> str:
    """The engine that runs ``target``: ``"llama"`` for :class:`~flashdraft.targets.llama.LlamaTarget`
    (its class attribute), ``"torch"`` for :class:`flashdraft.target.Target` and anything else
    without a ``backend`` attribute (test doubles)."""
    return getattr(target, "backend", "torch")
