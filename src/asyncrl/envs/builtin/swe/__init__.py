"""`swe`: SWE-bench-form repository tasks from disk, with shell and editor tools in a pooled sandbox."""

from asyncrl.envs.builtin.swe.env import SandboxSettings, SweEnv

__all__ = ["SandboxSettings", "SweEnv"]
