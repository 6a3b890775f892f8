"""The built-in corpora, chosen by `data.corpus` (`dlite.corpus.build`): `trajectories`
(synthetic OpenAI-style tool calls over standard-library source) and the agent-like one
(`agent_run` / `agent` / `agent_layouts`: a scripted agent running real commands on copies
of installed packages, saved in mini-swe-agent / SWE-agent / OpenHands layouts)."""
