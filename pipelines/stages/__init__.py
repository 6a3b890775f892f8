"""The Ray stages: collect, train, evaluate, publish, their input checks and the DeepSpeed engine."""
