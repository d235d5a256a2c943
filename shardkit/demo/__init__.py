"""`shardkit demo`: train the seed tutorial's MNIST-style CNNs sharded across local ranks on real digits."""
