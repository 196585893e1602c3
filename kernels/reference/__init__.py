"""PyTorch references: they define the result every faster kernel must reproduce."""
