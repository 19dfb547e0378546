"""Generative recommendation over semantic IDs: RQ-KMeans IDs, a prefix trie for constrained
decoding, an encoder-decoder from the LM's blocks with Instruction-Guided Retrieval and the
Q2I loss (OxygenREC, 2025; TIGER, 2023), and an SA-GCPO RL stage."""
