"""The built-in agent-trajectory corpus: OpenAI-style trajectories over real standard-library source, for any target."""
