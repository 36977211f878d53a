"""Training side of Shoal: corpus, model, inner loop, DiLoCo outer step, compression, trainer process."""
