"""asyncrl: asynchronous reinforcement learning for Mixture-of-Experts language models.

Process roles live in their own packages (inference, orchestrator, trainer); `asyncrl.model` is the
one transformer implementation that the trainer and the embedded inference engine share.
"""

__version__ = "0.1.0"
