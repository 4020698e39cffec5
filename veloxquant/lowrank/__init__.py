"""Low-rank machinery shared by methods: factors of a matrix (power iteration, truncated
SVD, the energy rule for a rank) and growing storage of per-chunk factors."""
