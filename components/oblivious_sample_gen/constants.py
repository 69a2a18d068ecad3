"""The custom properties ObliviousSampleGen's executor writes on the samples: the executor (and
the sampling descriptor's codec) write them under these names and DPTrainer reads them by these
names."""

DESCRIPTOR_PREFIX = "sampling_"  # every SamplingDescriptor field is stored under this prefix
SCHEME = DESCRIPTOR_PREFIX + "scheme"  # present exactly when the Examples carry a descriptor
ENCRYPTED = "sampling_encrypted"  # 1 if the sample records are encrypted
RECORD_WIDTH = "sampling_record_width"  # the padded record width, when encrypted
