"""Checkpoints on any fsspec URL: a new directory per checkpoint, committed by its manifest.

``format`` writes/reads one checkpoint (torch.save payloads, weights_only loads, sha256
manifest); ``store`` lists, prunes and loads the newest valid one, and saves in the background.
"""
