//! Parallel training for meshgrad (skeleton: strategies land with the parallel issues).
