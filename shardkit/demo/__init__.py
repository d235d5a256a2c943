"""`shardkit demo`: train the seed tutorial's MNIST-style CNNs sharded across local ranks on real digits.

Layout: cli (arguments and the printed summary), config (what a run is made of, without torch),
data (scikit-learn's digits per rank), models (the tutorial's CNNs), train (the per-rank loop,
``run_demo``), memory (per-rank memory against one unsharded copy)."""
