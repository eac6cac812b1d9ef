"""Every change alignfl makes to Flower's or Ray's behaviour."""
