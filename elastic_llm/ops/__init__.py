"""Operations on real Ray clusters: job submission (``submit``), the run's state as a table
(``status``), and the spot interruption watcher (``spot_watcher``). Each module is the body of
one CLI command; none of them trains or decides about recovery."""
