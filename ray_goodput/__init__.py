"""ray_goodput: fast, fault-tolerant PyTorch training on Ray Train."""
