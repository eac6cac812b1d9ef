"""Who gets which training samples: the partitioners with their settings (:mod:`.partitioners`), the partitions of
a data set computed once and cached, and each client's own train/test split (:mod:`.partitions`)."""
