"""Evidence that the fast paths are exact: differential campaigns (`tokenplane verify`), adversarial generators, real
agent traces."""
