//! A sled tree whose writes go through the write-ahead log: the only way stores write to disk.

use std::{ops::RangeBounds, sync::Arc};

use sled::{CompareAndSwapError, IVec};

use super::{DurableDb, log::Op};

/// One of a [`DurableDb`]'s trees. Reads are sled's; every write is applied to sled and its
/// record buffered for the log under one lock, so a write another caller can read is in the
/// log before any later [`DurableDb::commit`] is counted. A write is on disk once a commit
/// made after it returns. Keeps the database open while it lives.
#[derive(Clone)]
pub struct Tree {
    tree: sled::Tree,
    name: Arc<[u8]>,
    db: DurableDb,
}

/// The tree's name and database only, not its contents (see `DurableDb`'s `Debug`).
impl std::fmt::Debug for Tree {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tree")
            .field("name", &String::from_utf8_lossy(&self.name))
            .field("db", &self.db)
            .finish()
    }
}

impl Tree {
    pub(super) fn new(tree: sled::Tree, name: &str, db: DurableDb) -> Self {
        Self {
            tree,
            name: Arc::from(name.as_bytes()),
            db,
        }
    }

    /// The value of `key`, as sled's `get`.
    ///
    /// # Errors
    /// When sled fails.
    pub fn get(&self, key: impl AsRef<[u8]>) -> sled::Result<Option<IVec>> {
        self.tree.get(key)
    }

    /// Every entry in key order, as sled's `iter`.
    pub fn iter(&self) -> sled::Iter {
        self.tree.iter()
    }

    /// The entries in `range`, as sled's `range`.
    pub fn range<K: AsRef<[u8]>, R: RangeBounds<K>>(&self, range: R) -> sled::Iter {
        self.tree.range(range)
    }

    /// The entries whose keys start with `prefix`, as sled's `scan_prefix`.
    pub fn scan_prefix(&self, prefix: impl AsRef<[u8]>) -> sled::Iter {
        self.tree.scan_prefix(prefix)
    }

    /// How many entries the tree holds (a full scan, as sled's `len`).
    pub fn len(&self) -> usize {
        self.tree.len()
    }

    /// Whether the tree holds no entry.
    pub fn is_empty(&self) -> bool {
        self.tree.is_empty()
    }

    /// Sets `key` to `new` (removes it when `None`) if it holds `old` (is absent when `None`),
    /// as sled's `compare_and_swap`; logged when it swapped.
    ///
    /// The decision verb: refused, unapplied, while the disk stalls or after the log failed
    /// ([`super::STALLED_AFTER`]), so no decision is made that cannot be made durable. What
    /// follows from a decision already made is written with
    /// [`compare_and_swap_outcome`](Self::compare_and_swap_outcome) or the other writes.
    ///
    /// # Errors
    /// When sled fails, the disk stalls or the log has failed.
    pub fn compare_and_swap<K, OV, NV>(
        &self,
        key: K,
        old: Option<OV>,
        new: Option<NV>,
    ) -> sled::Result<Result<(), CompareAndSwapError>>
    where
        K: AsRef<[u8]>,
        OV: AsRef<[u8]>,
        NV: Into<IVec>,
    {
        self.db.log().rounds.writable()?;
        self.swap_logged(key.as_ref(), old, new.map(Into::into))
    }

    /// [`compare_and_swap`](Self::compare_and_swap) for what follows from a decision already
    /// made and acted on (the outcome of an effect that ran): taken while the disk stalls,
    /// like the other writes beside a decision, and refused, unapplied, only once the log
    /// has failed. Refusing it during a stall would drop the record of an effect that
    /// already happened, and a retry would run the effect again.
    ///
    /// # Errors
    /// When sled fails or the log has failed.
    pub fn compare_and_swap_outcome<K, OV, NV>(
        &self,
        key: K,
        old: Option<OV>,
        new: Option<NV>,
    ) -> sled::Result<Result<(), CompareAndSwapError>>
    where
        K: AsRef<[u8]>,
        OV: AsRef<[u8]>,
        NV: Into<IVec>,
    {
        self.swap_logged(key.as_ref(), old, new.map(Into::into))
    }

    fn swap_logged<OV: AsRef<[u8]>>(
        &self,
        key: &[u8],
        old: Option<OV>,
        new: Option<IVec>,
    ) -> sled::Result<Result<(), CompareAndSwapError>> {
        let mut log = self.db.log().lock();
        // Checked again under the lock the log fails under: a swap that passed the check
        // above as the log failed would be applied and read with no record behind it.
        log.taking()?;
        let swapped = self.tree.compare_and_swap(key, old, new.clone())?;
        if swapped.is_ok() {
            log.push(self.op(key, new.as_deref()));
        }
        Ok(swapped)
    }

    /// Sets `key` to `value`, answering the value it held, as sled's `insert`; logged.
    ///
    /// # Errors
    /// When sled fails, or the log has failed (nothing is then applied).
    pub fn insert(
        &self,
        key: impl AsRef<[u8]>,
        value: impl Into<IVec>,
    ) -> sled::Result<Option<IVec>> {
        let (key, value) = (key.as_ref(), value.into());
        let mut log = self.db.log().lock();
        // As for a swap: once the log failed, nothing is applied that no record backs.
        log.taking()?;
        let old = self.tree.insert(key, value.clone())?;
        log.push(self.op(key, Some(&value)));
        Ok(old)
    }

    /// Removes `key`, answering the value it held, as sled's `remove`; logged.
    ///
    /// # Errors
    /// When sled fails, or the log has failed (nothing is then applied).
    pub fn remove(&self, key: impl AsRef<[u8]>) -> sled::Result<Option<IVec>> {
        let key = key.as_ref();
        let mut log = self.db.log().lock();
        log.taking()?;
        let old = self.tree.remove(key)?;
        if old.is_some() {
            log.push(self.op(key, None));
        }
        Ok(old)
    }

    /// Removes every entry, as sled's `clear`; logged.
    ///
    /// # Errors
    /// When sled fails, or the log has failed (nothing is then applied).
    pub fn clear(&self) -> sled::Result<()> {
        let mut log = self.db.log().lock();
        log.taking()?;
        self.tree.clear()?;
        log.push(Op::Clear { tree: &self.name });
        Ok(())
    }

    fn op<'a>(&'a self, key: &'a [u8], value: Option<&'a [u8]>) -> Op<'a> {
        match value {
            Some(value) => Op::Put {
                tree: &self.name,
                key,
                value,
            },
            None => Op::Remove {
                tree: &self.name,
                key,
            },
        }
    }
}
