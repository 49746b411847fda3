"""Engines that run the target behind one contract (:mod:`flashdraft.targets.base`): torch (the
reference, :mod:`flashdraft.targets.torch`) and llama.cpp (``--backend llama``, :mod:`flashdraft.targets.llama`)."""
