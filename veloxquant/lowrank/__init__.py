"""Low-rank machinery shared by methods: factors of a matrix (subspace iteration,
truncated SVD, the energy rule for a rank) and growing storage of per-chunk factors."""
