"""`swe-lite`: fix a planted bug in a tiny Python repository, with file and test tools."""

from asyncrl.envs.builtin.swe_lite.env import SweLiteEnv

__all__ = ["SweLiteEnv"]
