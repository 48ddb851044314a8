"""Training the learned scorers' predictors: teacher scores on prose, then one small fit per head."""
