"""The composition root: Session, RunConfig, the llama.cpp seam, recipes and the CLI."""
