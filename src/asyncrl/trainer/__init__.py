"""The trainer process: RL and SFT loops, losses (pure functions), checkpoints, weight publishing.

Entry points: `asyncrl trainer @ rl.toml` (asyncrl.trainer.rl) and `asyncrl sft @ sft.toml`
(asyncrl.trainer.sft). See docs/trainer.md.
"""
