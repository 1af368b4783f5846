"""Training stages and their libraries: the shared loop, featurizer, pretrain, finetune, threshold, bundle."""
