"""Small verifiers (0.4, `verifiers.v1`) environments written as its docs show, for the adapter tests."""
