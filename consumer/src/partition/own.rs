//! Taking a partition over: the claim that bumps its epoch, the seek to the stored offset,
//! the stall check and the backoff between takeovers.

use std::time::Duration;

use rdkafka::consumer::Consumer;
use rdkafka::Offset;

use crate::offsets::{self, Ownership};

use super::{tpl, Owned, Step, Worker};

impl Worker {
    /// One ownership of the partition: claims it in the database (bumping its epoch), seeks
    /// to the stored offset and processes records until cancelled or fenced.
    pub(super) async fn own(&mut self, floor: Option<i64>) -> Owned {
        let Some(own) = self.claim().await else {
            return Owned::Ended;
        };
        if !self.load_held().await {
            return Owned::Ended;
        }
        if self.topic_stopped().await {
            return self.parked(own.epoch).await;
        }
        match self.partitions_vanished().await {
            None => return Owned::Ended,
            Some(true) => return self.parked(own.epoch).await,
            Some(false) => {}
        }
        if *self.paused.lock().expect("pause flag") {
            // Parked by an earlier ownership (its topic was stopped, and has been reset since).
            self.resume_fetching();
        }
        // Nothing committed yet: records from `floor` on were dropped by an earlier, fenced
        // ownership of this worker and must be read again.
        let mut next = own.next_offset.or(floor);
        let mut lowest: Option<i64> = None;
        // Until the first record is processed: whether the seek to the stored offset was
        // verified (see below), and while a second seek is awaited, the first offset seen
        // above the stored one.
        let mut verified = false;
        let mut landing: Option<i64> = None;
        let mut landing_since = std::time::Instant::now();
        let mut first = true;
        if let Some(n) = next {
            // Asynchronous seek (timeout 0): records below `n` that were fetched before it
            // takes effect are skipped below; records above it are checked (`verified`).
            if let Err(e) = self.shared.consumer.seek(
                &self.topic,
                self.partition,
                Offset::Offset(n),
                Duration::ZERO,
            ) {
                tracing::warn!(error = %e, topic = %self.topic, partition = self.partition, stored = n, "seek to the stored offset failed; skipping older records instead");
            }
        }
        tracing::debug!(topic = %self.topic, partition = self.partition, epoch = own.epoch, next_offset = ?next, "partition taken over");
        let max_batch = self.shared.config.max_batch;
        // The (stored offset, high watermark) of the last stall recovery (see `check_stall`).
        let mut last_stall = None;
        // When a busy partition last looked whether the group stopped its topic.
        let mut stop_checked = std::time::Instant::now();
        // When the partition last looked for releases of its held keys.
        let mut releases_checked: Option<std::time::Instant> = None;
        // A release goes on (it settles `RELEASE_CHUNK` held records a look): look again as
        // soon as no record waits.
        let mut releasing = false;
        // Since when no record has arrived: the idle check runs `stall_check` after it, also
        // when the held keys' release look-ups (`held_poll`, shorter) wake the loop meanwhile.
        let mut idle_since = std::time::Instant::now();
        loop {
            let any_held = !self.held.lock().expect("held keys").is_empty();
            if any_held
                && (releasing
                    || releases_checked.is_none_or(|t| t.elapsed() >= self.shared.config.held_poll))
            {
                releases_checked = Some(std::time::Instant::now());
                let (step, more) = self.apply_releases(&own).await;
                releasing = more;
                match step {
                    Step::Done | Step::OverBound(_) => {}
                    Step::Paused => return self.held(lowest, Vec::new(), true).await,
                    Step::Stop => return Owned::Ended,
                    Step::Fenced if self.cancel.is_cancelled() => return Owned::Ended,
                    Step::Fenced => return Owned::Fenced(lowest),
                }
            }
            // About to wait for records: with none queued, nothing waits ([`crate::stall`]).
            self.queued.waiting.idle_unless(|| self.queued.any());
            let head = tokio::select! {
                biased;
                _ = self.cancel.cancelled() => return Owned::Ended,
                r = self.rx.recv() => match r { Some(r) => r, None => return Owned::Ended },
                _ = tokio::time::sleep_until((idle_since + self.shared.config.stall_check).into()) => {
                    idle_since = std::time::Instant::now();
                    // Idle: another claim (a `postal consumer reset` moving the stored offset,
                    // a late claim from elsewhere) shows only at the next commit, and none
                    // comes without records: look at the epoch now.
                    if self.epoch_moved(own.epoch).await {
                        return Owned::Fenced(lowest);
                    }
                    stop_checked = std::time::Instant::now();
                    if self.topic_stopped().await {
                        return self.parked(own.epoch).await;
                    }
                    match (landing, next) {
                        // The second seek has not shown yet (lost?): issue it again.
                        (Some(seen), Some(n)) => {
                            landing_since = std::time::Instant::now();
                            match self.seek_stored(n, seen).await {
                                Some(bound) => landing = Some(bound),
                                None => return Owned::Ended,
                            }
                        }
                        _ => match self.check_stall(next, &mut last_stall).await {
                            None => return Owned::Ended,
                            Some(true) => return self.parked(own.epoch).await,
                            Some(false) => {}
                        },
                    }
                    continue;
                }
                // (After the idle check: it runs `stall_check` after the last record arrived,
                // also while a long release goes on.)
                // A release going on: its next records (no record waits).
                _ = std::future::ready(()), if releasing && any_held => continue,
                // Held keys: look for their releases while no records come.
                _ = tokio::time::sleep(self.shared.config.held_poll), if any_held => continue,
            };
            idle_since = std::time::Instant::now();
            let mut records = vec![head];
            while records.len() < max_batch {
                match self.rx.try_recv() {
                    Ok(r) => records.push(r),
                    Err(_) => break,
                }
            }
            self.dequeued(records.len(), records.iter().map(|r| r.weight).sum());
            if own.next_offset.is_none() {
                let o = records[0].offset;
                lowest = Some(lowest.map_or(o, |l: i64| l.min(o)));
            }
            if let Some(seen) = landing {
                // After the second seek the fetch restarts at the stored offset: records from
                // before it (all above `seen`, and queued ahead of any fetched after it) are
                // dropped until one at or below `seen` shows that the seek took effect.
                match records.iter().position(|r| r.offset <= seen) {
                    None => {
                        // Still the old position after a while on a busy partition: the seek
                        // was lost; issue it again (the idle tick never fires here).
                        if let (Some(n), true) = (
                            next,
                            landing_since.elapsed() >= self.shared.config.stall_check,
                        ) {
                            landing_since = std::time::Instant::now();
                            match self.seek_stored(n, seen).await {
                                Some(bound) => landing = Some(bound),
                                None => return Owned::Ended,
                            }
                        }
                        continue;
                    }
                    Some(p) => {
                        records.drain(..p);
                        landing = None;
                    }
                }
            }
            if let (true, Some(n)) = (first, next) {
                if records[0].offset > n && !verified {
                    // The fetch started above the stored offset: fetched before the seek took
                    // effect (a reassignment in this process, or Kafka's group offset ahead of
                    // the stored one after `postal consumer reset`), or there really is nothing
                    // in between. Processing it could skip records: seek again and drop what
                    // comes until the seek shows.
                    verified = true;
                    landing_since = std::time::Instant::now();
                    match self.seek_stored(n, records[0].offset).await {
                        Some(bound) => landing = Some(bound),
                        None => return Owned::Ended,
                    }
                    continue;
                }
                if records[0].offset > n {
                    tracing::warn!(topic = %self.topic, partition = self.partition, stored = n, first = records[0].offset,
                        "the broker delivered the partition from a later offset than the stored one, also after a second seek: records in between were not seen (compaction, retention, transaction markers, or a broker fault)");
                }
            }
            first = false;
            if stop_checked.elapsed() >= self.shared.config.stall_check {
                // Another partition of the topic (here or in another process of the group)
                // may have found its log replaced: this one's may be too, unseen.
                stop_checked = std::time::Instant::now();
                if self.topic_stopped().await {
                    return self.parked(own.epoch).await;
                }
            }
            if let (Some(n), Some(tail)) = (next, records.last().map(|r| r.offset)) {
                if records.iter().any(|r| r.offset < n) {
                    // Below the stored offset: a redelivery, or a new log (a re-created topic)?
                    // The watermarks decide (`crate::replaced`), once for the whole run: the
                    // run's records queued now come along (and the first one after it, which
                    // keeps the batch within `max_batch`: the batch held only the run).
                    if tail < n {
                        let (mut more, mut bytes) = (0, 0);
                        while let Ok(r) = self.rx.try_recv() {
                            more += 1;
                            bytes += r.weight;
                            let done = r.offset >= n;
                            records.push(r);
                            if done {
                                break;
                            }
                        }
                        self.dequeued(more, bytes);
                    }
                    match self.log_replaced(n).await {
                        None => return Owned::Ended,
                        Some(true) => return self.parked(own.epoch).await,
                        Some(false) => {}
                    }
                }
            }
            // Offsets strictly increase from the stored one: a record below it (a redelivery:
            // checked above), or at or below one already taken (the two seeks of a takeover
            // can both deliver a run from the stored offset), is dropped.
            let mut floor_offset = next.unwrap_or(i64::MIN);
            records.retain(|r| {
                let below = r.offset < floor_offset;
                if !below {
                    floor_offset = r.offset + 1;
                }
                if below {
                    tracing::trace!(topic = %self.topic, partition = self.partition, offset = r.offset, "below the stored offset; skipped");
                    self.shared
                        .stats
                        .replays_skipped(&self.shared.config.consumer, &self.topic, 1);
                }
                !below
            });
            let Some(last) = records.last().map(|r| r.offset) else {
                continue;
            };
            if self.shared.pauses.covers(&self.topic) {
                return self.held(lowest, records, false).await;
            }
            let permit = tokio::select! {
                biased;
                _ = self.cancel.cancelled() => return Owned::Ended,
                p = self.shared.permits.acquire() => match p { Ok(p) => p, Err(_) => return Owned::Ended },
            };
            let step = if records.len() == 1 {
                self.process(&own, &records[0]).await
            } else {
                self.process_batch(&own, records).await
            };
            drop(permit);
            match step {
                Step::Paused => return self.held(lowest, Vec::new(), true).await,
                Step::OverBound(need) => return self.over_bound(&own, lowest, need).await,
                Step::Done => {
                    next = Some(last + 1);
                    self.queued.waiting.advanced();
                    if !self.cancel.is_cancelled() {
                        self.shared
                            .state
                            .lock()
                            .expect("ownership state")
                            .pending_commits
                            .insert((self.topic.clone(), self.partition), last + 1);
                    }
                }
                Step::Stop => return Owned::Ended,
                Step::Fenced if self.cancel.is_cancelled() => return Owned::Ended,
                Step::Fenced => return Owned::Fenced(lowest),
            }
        }
    }

    /// Seeks to the stored offset `n` after records arrived from `seen` (above `n`), waiting
    /// for librdkafka to take the seek (retried a few times if it fails). Returns the landing
    /// bound: the seek has taken effect once a record at or below it arrives. `None` if
    /// cancelled meanwhile.
    ///
    /// If retention (or delete-records) moved the partition's log start past `n`, the records
    /// in between are gone: the seek goes to the log start instead, and when that is above
    /// `seen` the bound is the log start (every record from `n` to `seen` is gone, so a record
    /// of the earlier fetch at or below it is as good a start as the seek's).
    pub(super) async fn seek_stored(&mut self, n: i64, seen: i64) -> Option<i64> {
        // A partition paused meanwhile (its buffer was full) would never deliver the record
        // that shows the seek took effect.
        self.resume_fetching();
        let low = {
            let consumer = self.shared.consumer.clone();
            let (topic, partition) = (self.topic.clone(), self.partition);
            tokio::task::spawn_blocking(move || {
                consumer.fetch_watermarks(&topic, partition, Duration::from_secs(5))
            })
            .await
            .ok()
            .and_then(Result::ok)
            .map(|(low, _)| low)
        };
        let target = match low {
            Some(low) if low > n => {
                tracing::warn!(topic = %self.topic, partition = self.partition, stored = n, log_start = low,
                    "records from the stored offset to the partition's log start were removed (retention or delete-records) before this group processed them; resuming from the log start");
                self.shared.stats.records_expired(
                    &self.shared.config.consumer,
                    &self.topic,
                    (low - n) as u64,
                );
                low
            }
            _ => n,
        };
        tracing::info!(topic = %self.topic, partition = self.partition, stored = n, target, first = seen,
            "records arrived from above the stored offset; seeking to the stored offset again");
        let mut failures = 0u32;
        loop {
            let consumer = self.shared.consumer.clone();
            let (topic, partition) = (self.topic.clone(), self.partition);
            let r = tokio::task::spawn_blocking(move || {
                consumer.seek(
                    &topic,
                    partition,
                    Offset::Offset(target),
                    Duration::from_secs(10),
                )
            })
            .await;
            match r {
                Ok(Ok(())) => break,
                Ok(Err(e)) if failures < 5 => {
                    tracing::warn!(error = %e, topic = %self.topic, partition = self.partition, stored = n, "seek to the stored offset failed; retrying");
                }
                Ok(Err(e)) => {
                    // Records above the stored offset are still dropped until one at or below
                    // `seen` comes; the stall check seeks again meanwhile.
                    tracing::warn!(error = %e, topic = %self.topic, partition = self.partition, stored = n, "seek to the stored offset keeps failing; trying again after the stall check");
                    break;
                }
                Err(_) => return None,
            }
            if !self.wait(failures).await {
                return None;
            }
            failures += 1;
        }
        (!self.cancel.is_cancelled()).then_some(seen.max(target))
    }

    /// Nothing arrived for `stall_check`: if the broker has records at or beyond the stored
    /// offset `next`, the fetch position was lost (seen with a Kafka-protocol broker after a
    /// consumer restart);
    /// resume the partition and seek to `next` again. Seeking to the stored offset never skips
    /// a record: anything below it is dropped on arrival, as after any seek. Done once per
    /// (stored offset, high watermark): offsets that hold no deliverable record (transaction
    /// markers of transactional producers) keep the high watermark ahead of the stored offset
    /// without any stall, and must not warn every `stall_check`.
    ///
    /// A high watermark below the stored offset is no stall but a replaced log (a re-created
    /// topic, another cluster; `crate::replaced`): `Some(true)`, the topic must stop. `None`
    /// if cancelled meanwhile.
    pub(super) async fn check_stall(
        &self,
        next: Option<i64>,
        last: &mut Option<(i64, i64)>,
    ) -> Option<bool> {
        let Some(n) = next else {
            return Some(false);
        };
        let consumer = self.shared.consumer.clone();
        let (topic, partition) = (self.topic.clone(), self.partition);
        let high = tokio::task::spawn_blocking(move || {
            consumer.fetch_watermarks(&topic, partition, Duration::from_secs(5))
        })
        .await;
        let Ok(Ok((_, high))) = high else {
            return Some(false);
        };
        if crate::replaced::impossible(n, high) {
            return self.log_replaced(n).await;
        }
        if high == n || self.cancel.is_cancelled() || *last == Some((n, high)) {
            return Some(false);
        }
        *last = Some((n, high));
        tracing::warn!(topic = %self.topic, partition = self.partition, stored = n, high_watermark = high,
            idle_ms = self.shared.config.stall_check.as_millis() as u64,
            "no records from an owned partition although the broker has more; seeking to the stored offset again");
        self.shared
            .stats
            .stalls_recovered(&self.shared.config.consumer, &self.topic, 1);
        self.resume_fetching();
        if let Err(e) = self.shared.consumer.seek(
            &self.topic,
            self.partition,
            Offset::Offset(n),
            Duration::ZERO,
        ) {
            tracing::warn!(error = %e, topic = %self.topic, partition = self.partition, "seek to the stored offset failed");
        }
        Some(false)
    }

    /// The partition's topic (or group) is paused: stops fetching from it, drops what was
    /// fetched (`taken`, and what arrives), and waits until it is resumed. `found`: a
    /// transaction found the pause before this runtime's view of the pauses did; the view is
    /// read once more before it counts. Then the partition is taken over again from the stored
    /// offset ([`Owned::Resumed`]); nothing of it was applied meanwhile.
    pub(super) async fn held(
        &mut self,
        lowest: Option<i64>,
        taken: Vec<crate::record::Record>,
        found: bool,
    ) -> Owned {
        // Dequeued already (and counted in `lowest`): read again after the resume.
        drop(taken);
        {
            let mut paused = self.paused.lock().expect("pause flag");
            match self
                .shared
                .consumer
                .pause(&tpl(&self.topic, self.partition))
            {
                Ok(()) => *paused = true,
                Err(e) => {
                    tracing::debug!(error = %e, topic = %self.topic, partition = self.partition, "pausing the partition at the broker failed; its records are dropped as they come")
                }
            }
        }
        tracing::debug!(group = %self.shared.config.group, topic = %self.topic, partition = self.partition, "partition held: its topic is paused");
        // Counted while it waits here (`StatsSnapshot::partitions_paused`), whichever way the
        // wait ends.
        struct Held<'a>(&'a crate::stats::Stats);
        impl Drop for Held<'_> {
            fn drop(&mut self) {
                self.0.held(false);
            }
        }
        self.shared.stats.held(true);
        let stats = self.shared.stats.clone();
        let _held = Held(&stats);
        let mut view = self.shared.pauses.subscribe();
        if found {
            view.mark_unchanged();
        } else {
            view.mark_changed();
        }
        loop {
            tokio::select! {
                biased;
                _ = self.cancel.cancelled() => return Owned::Ended,
                r = self.rx.recv() => match r {
                    Some(r) => {
                        self.queued.sub(1, r.weight);
                        self.shared.stats.buffered(-(r.weight as i64));
                    }
                    None => return Owned::Ended,
                },
                changed = view.changed() => {
                    if changed.is_err() {
                        return Owned::Ended;
                    }
                    if !view.borrow_and_update().covers(&self.topic) {
                        break;
                    }
                }
            }
        }
        // Records waiting from now on: the wait while paused was no stall.
        self.queued.waiting.advanced();
        Owned::Resumed(lowest)
    }

    /// Resumes fetching from the partition (it may have been paused when its buffer filled).
    pub(super) fn resume_fetching(&self) {
        let mut paused = self.paused.lock().expect("pause flag");
        if self
            .shared
            .consumer
            .resume(&tpl(&self.topic, self.partition))
            .is_ok()
        {
            *paused = false;
        }
    }

    /// Whether the partition's epoch in the database moved past `epoch` (another claim).
    /// A database error counts as "no": the next commit finds out.
    pub(super) async fn epoch_moved(&self, epoch: i64) -> bool {
        let current: Result<Option<i64>, sqlx::Error> = sqlx::query_scalar(
            "SELECT epoch FROM postal.consumer_offsets
             WHERE group_id = $1 AND topic = $2 AND partition = $3",
        )
        .bind(&self.shared.config.group)
        .bind(&self.topic)
        .bind(self.partition)
        .fetch_optional(&self.shared.pool)
        .await;
        let moved = matches!(current, Ok(Some(e)) if e != epoch);
        if moved {
            self.shared
                .stats
                .fenced(&self.shared.config.consumer, &self.topic, 1);
        }
        moved
    }

    pub(super) fn dequeued(&self, n: usize, bytes: usize) {
        self.queued.sub(n, bytes);
        self.shared.stats.buffered(-(bytes as i64));
        if self.queued.drained(&self.shared) {
            let mut paused = self.paused.lock().expect("pause flag");
            if *paused && self.queued.drained(&self.shared) {
                match self
                    .shared
                    .consumer
                    .resume(&tpl(&self.topic, self.partition))
                {
                    Ok(()) => *paused = false,
                    Err(e) => {
                        tracing::warn!(error = %e, topic = %self.topic, partition = self.partition, "resuming the partition failed")
                    }
                }
            }
        }
    }

    /// Takes the partition over in the database; waits (with backoff) while it is unreachable.
    pub(super) async fn claim(&self) -> Option<Ownership> {
        let mut failures = 0u32;
        loop {
            let r = offsets::claim(
                &self.shared.pool,
                &self.shared.config.group,
                &self.topic,
                self.partition,
                &self.shared.owner,
            )
            .await;
            match r {
                Ok(o) => return Some(o),
                Err(e) => {
                    tracing::warn!(error = %e, topic = %self.topic, partition = self.partition, "cannot read the stored offset; retrying");
                    if !self.wait(failures).await {
                        return None;
                    }
                    failures = failures.saturating_add(1);
                }
            }
        }
    }

    /// Sleeps for the backoff of `attempt`; `false` if cancelled meanwhile.
    pub(crate) async fn wait(&self, attempt: u32) -> bool {
        let d = self.shared.config.backoff.delay(attempt);
        tokio::select! {
            _ = tokio::time::sleep(d) => true,
            _ = self.cancel.cancelled() => false,
        }
    }
}
