"""The model as a file and a shape: checkpoint headers and folder checks, downloads, the meta
model, hardware limits, the memory plan."""
