"""Stand-ins for tests and simulations, not for training scripts.

* ``fake_nvml``: :class:`~torchpass_p2p.testing.fake_nvml.FakeNvml`, a scriptable stand-in
  for the ``pynvml`` module that :mod:`torchpass_p2p.agent.health` accepts in its place.

Nothing in the library imports from here; a training script has no use for it.
"""
