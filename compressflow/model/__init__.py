"""The model as a file and a shape: checkpoint headers, the meta model, hardware limits, the memory plan."""
