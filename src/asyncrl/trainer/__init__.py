"""The trainer process: RL and SFT loops, losses (pure functions), checkpoints, weight publishing.

Entry points: `asyncrl trainer @ rl.toml` (asyncrl.trainer.main, the RL loop in asyncrl.trainer.rl)
and `asyncrl sft @ sft.toml` (asyncrl.trainer.sft). One step of either is asyncrl.trainer.step's
`StepRunner`. See docs/trainer.md.
"""
