"""The orchestrator: samples tasks, runs rollout groups against inference over HTTP, computes
advantages, enforces staleness bounds, writes batches, and drives weight updates."""
