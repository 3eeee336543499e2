"""Record the field names `oblr-trl train` accepts from TRL and transformers (after a version change of either):

    python scripts/record_trainer_fields.py

then set `RECORDED_FOR` in `oblr_trl/trainer_fields.py` as printed.
"""

from oblr_trl.cli import installed_trainer_fields
from oblr_trl.trainer_fields import write_record

if __name__ == "__main__":
    print(write_record(installed_trainer_fields()))
