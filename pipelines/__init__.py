"""The Ray stages (collect, train, evaluate, publish): thin adapters that run the pure
`dlite` library on Ray Data / Ray Train. Ray-specific code lives here, never in `dlite/`."""
