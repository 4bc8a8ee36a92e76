"""The served model: loading it in the background, its positions, path confinement, demo and random models."""
