//! The shared-memory formats of the local API and a read-only mapping.
//!
//! An application writes its input into a file (normally under `/dev/shm`)
//! and passes the path; the daemon maps it and feeds the sender machine
//! straight from the mapping, so tuples are never copied through the Unix
//! socket. Two input formats:
//!
//! * `tuples`: records `key_len u16 LE | value i64 LE | key bytes`;
//! * `text`: raw bytes; every word (split at ASCII whitespace, as Python's
//!   `bytes.split()`) counts 1 — WordCount without materialising pairs.
//!
//! Results go back the same way: the daemon writes records
//! `key_len u16 LE | sum i64 LE | count u64 LE | min i64 LE | max i64 LE |
//! key bytes` into a new file and returns its path.
//!
//! Keys of 65 535 bytes or more: `key_len` is 0xFFFF and a `u32 LE` with
//! the real length follows the fixed head, before the key (both formats).

use std::fs::File;
use std::io::Write;
use std::path::Path;

use fanin_proto::kv::Aggregate;

/// Bytes before the key in a `tuples` record.
pub const TUPLE_HEAD: usize = 10;
/// Bytes before the key in a result record.
pub const RESULT_HEAD: usize = 34;
/// `key_len` meaning "the length is the `u32 LE` after the fixed head".
pub const LONG_KEY_MARK: u16 = u16::MAX;

/// Write a key's length as `key_len` (returned) and the extension to put
/// after the fixed head (empty for keys under 65 535 bytes).
fn key_len_fields(len: usize) -> Result<(u16, Vec<u8>), KeyTooLong> {
    if len < LONG_KEY_MARK as usize {
        return Ok((len as u16, Vec::new()));
    }
    let len = u32::try_from(len).map_err(|_| KeyTooLong(len))?;
    Ok((LONG_KEY_MARK, len.to_le_bytes().to_vec()))
}

/// The key length of a record whose fixed head ends at `after_head`, and
/// where its key starts; `None` if the extension is cut short.
fn read_key_len(bytes: &[u8], key_len: u16, after_head: usize) -> Option<(usize, usize)> {
    if key_len != LONG_KEY_MARK {
        return Some((key_len as usize, after_head));
    }
    let ext = bytes.get(after_head..after_head + 4)?;
    Some((u32::from_le_bytes(ext.try_into().expect("4 bytes")) as usize, after_head + 4))
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InputFormat {
    Tuples,
    Text,
}

impl InputFormat {
    pub fn parse(name: &str) -> Option<Self> {
        match name {
            "tuples" => Some(Self::Tuples),
            "text" => Some(Self::Text),
            _ => None,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum InputError {
    #[error("truncated record at byte {offset} of the input ({len} bytes): records are key_len u16 | value i64 | [key_len u32 if 0xFFFF] | key")]
    Truncated { offset: usize, len: usize },
}

impl InputError {
    /// The same error, for a cursor that started `base` bytes into the input.
    pub fn offset_by(self, base: usize) -> Self {
        match self {
            Self::Truncated { offset, len } => Self::Truncated { offset: offset + base, len: len + base },
        }
    }
}

/// Python's `bytes.split()` whitespace: space, \t, \n, \v, \f, \r.
fn is_space(b: u8) -> bool {
    matches!(b, b' ' | b'\t' | b'\n' | 0x0b | 0x0c | b'\r')
}

/// Reads tuples out of an input, a bounded number per call, so a daemon
/// thread interleaves reading with sending (a sender machine holds only a
/// window of the input).
pub struct Cursor<'a> {
    bytes: &'a [u8],
    pos: usize,
    format: InputFormat,
}

impl<'a> Cursor<'a> {
    pub fn new(bytes: &'a [u8], format: InputFormat) -> Self {
        Self { bytes, pos: 0, format }
    }

    /// A cursor resuming at `offset` (a boundary an earlier cursor reached).
    pub fn at(bytes: &'a [u8], format: InputFormat, offset: usize) -> Self {
        Self { bytes, pos: offset.min(bytes.len()), format }
    }

    pub fn offset(&self) -> usize {
        self.pos
    }

    /// The next tuple, `None` at the end, `Err` on a malformed record.
    pub fn next_tuple(&mut self) -> Result<Option<(&'a [u8], i64)>, InputError> {
        let b = self.bytes;
        match self.format {
            InputFormat::Tuples => {
                if self.pos == b.len() {
                    return Ok(None);
                }
                let truncated = InputError::Truncated { offset: self.pos, len: b.len() };
                let head = b.get(self.pos..self.pos + TUPLE_HEAD).ok_or(truncated.clone())?;
                let value = i64::from_le_bytes(head[2..10].try_into().expect("8 bytes"));
                let (key_len, start) = read_key_len(b, u16::from_le_bytes([head[0], head[1]]), self.pos + TUPLE_HEAD)
                    .ok_or(truncated.clone())?;
                let key = b.get(start..start.saturating_add(key_len)).ok_or(truncated)?;
                self.pos = start + key_len;
                Ok(Some((key, value)))
            }
            InputFormat::Text => {
                while self.pos < b.len() && is_space(b[self.pos]) {
                    self.pos += 1;
                }
                if self.pos == b.len() {
                    return Ok(None);
                }
                let start = self.pos;
                while self.pos < b.len() && !is_space(b[self.pos]) {
                    self.pos += 1;
                }
                Ok(Some((&b[start..self.pos], 1)))
            }
        }
    }
}

/// A channel's input file, read in chunks as the sender needs it
/// (`pread`), up to the length it had when it was opened.
///
/// Not a mapping: a mapped file that another process truncates while it is
/// read raises SIGBUS, and the whole daemon (every task on the host) died
/// of one caller's file. Read, a file that shrinks is an error of its own
/// channel ([`InputFile::window`]).
pub struct InputFile {
    file: File,
    len: u64,
    /// Bytes `start .. start + buf.len()` of the file.
    buf: Vec<u8>,
    start: u64,
}

/// What one read takes at least.
const READ_CHUNK: usize = 4 << 20;

impl InputFile {
    pub fn open(path: &Path) -> std::io::Result<Self> {
        let file = File::open(path)?;
        let len = file.metadata()?.len();
        Ok(Self { file, len, buf: Vec::new(), start: 0 })
    }

    /// The file's length when it was opened.
    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The file's bytes from `offset`: at least `want` of them, or all
    /// that is left (then the second value is true: they reach the end).
    /// An error if the file is now shorter than it was when opened.
    pub fn window(&mut self, offset: u64, want: usize) -> std::io::Result<(&[u8], bool)> {
        use std::os::unix::fs::FileExt;
        let end = self.len.min(offset.saturating_add(want as u64));
        let held = self.start..self.start + self.buf.len() as u64;
        if !(held.contains(&offset) || offset == held.end) || held.end < end {
            let take = (self.len - offset.min(self.len)).min(want.max(READ_CHUNK) as u64) as usize;
            self.buf.clear();
            self.buf.resize(take, 0);
            let mut got = 0;
            while got < take {
                match self.file.read_at(&mut self.buf[got..], offset + got as u64) {
                    Ok(0) => {
                        return Err(std::io::Error::other(format!(
                            "the input file shrank while it was being sent: {} bytes when the send began, \
                             {} now (the caller's file must stay as it is until the send returns)",
                            self.len,
                            offset + got as u64
                        )))
                    }
                    Ok(n) => got += n,
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                    Err(e) => return Err(e),
                }
            }
            self.start = offset;
        }
        let from = (offset - self.start) as usize;
        let bytes = &self.buf[from..];
        Ok((bytes, self.start + self.buf.len() as u64 == self.len))
    }
}

#[cfg(test)]
mod input_file_tests {
    use super::*;

    #[test]
    fn an_input_file_is_read_in_windows_and_one_that_shrinks_is_an_error_not_a_signal() {
        let path = std::env::temp_dir().join(format!("fanin-input-{}", std::process::id()));
        let data: Vec<u8> = (0..10_000u32).flat_map(|i| i.to_le_bytes()).collect();
        std::fs::write(&path, &data).unwrap();
        let mut f = InputFile::open(&path).unwrap();
        assert_eq!(f.len(), 40_000);
        let (bytes, end) = f.window(0, 16).unwrap();
        assert!(end && bytes == &data[..], "a file under a chunk is read whole");
        let (bytes, end) = f.window(39_996, 16).unwrap();
        assert_eq!((bytes, end), (&data[39_996..], true));
        assert_eq!(f.window(40_000, 16).unwrap(), (&[][..], true));
        // another process truncates it: the next read past what is held fails
        let mut g = InputFile::open(&path).unwrap();
        std::fs::OpenOptions::new().write(true).open(&path).unwrap().set_len(100).unwrap();
        let err = g.window(0, 16).unwrap_err();
        assert!(err.to_string().contains("shrank"), "{err}");
        std::fs::remove_file(&path).unwrap();
    }
}

/// Write results as result records.
pub fn write_results<'a>(
    path: &Path,
    results: impl Iterator<Item = (&'a Vec<u8>, &'a Aggregate)>,
) -> std::io::Result<u64> {
    let mut out = std::io::BufWriter::new(File::create(path)?);
    let mut n = 0;
    for (key, agg) in results {
        let (key_len, ext) = key_len_fields(key.len()).map_err(std::io::Error::other)?;
        out.write_all(&key_len.to_le_bytes())?;
        out.write_all(&agg.sum.to_le_bytes())?;
        out.write_all(&agg.count.to_le_bytes())?;
        out.write_all(&agg.min.to_le_bytes())?;
        out.write_all(&agg.max.to_le_bytes())?;
        out.write_all(&ext)?;
        out.write_all(key)?;
        n += 1;
    }
    out.flush()?;
    Ok(n)
}

/// A result file that ends inside a record.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("result record at byte {offset} is cut short ({len} bytes in all)")]
pub struct TruncatedResults {
    pub offset: usize,
    pub len: usize,
}

/// The records of a result file ([`write_results`]), in order, borrowing
/// their keys; an `Err` ends the iteration.
pub fn read_results(bytes: &[u8]) -> impl Iterator<Item = Result<(&[u8], Aggregate), TruncatedResults>> {
    let mut at = 0usize;
    std::iter::from_fn(move || {
        if at >= bytes.len() {
            return None;
        }
        let cut = TruncatedResults { offset: at, len: bytes.len() };
        let Some(head) = bytes.get(at..at + RESULT_HEAD) else {
            at = bytes.len();
            return Some(Err(cut));
        };
        let word = |i: usize| u64::from_le_bytes(head[2 + 8 * i..10 + 8 * i].try_into().expect("8 bytes"));
        let Some((klen, start)) = read_key_len(bytes, u16::from_le_bytes([head[0], head[1]]), at + RESULT_HEAD) else {
            at = bytes.len();
            return Some(Err(cut));
        };
        let Some(key) = bytes.get(start..start.saturating_add(klen)) else {
            at = bytes.len();
            return Some(Err(cut));
        };
        at = start + klen;
        let agg = Aggregate { sum: word(0) as i64, count: word(1), min: word(2) as i64, max: word(3) as i64 };
        Some(Ok((key, agg)))
    })
}

/// A key longer than a record's u32 length can say.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("key of {0} bytes cannot be encoded (at most 4294967295)")]
pub struct KeyTooLong(pub usize);

/// Append one record of the `tuples` format (the one encoder: Rust callers,
/// and `fanin.kv.encode_tuples` through the Python extension).
pub fn push_tuple(out: &mut Vec<u8>, key: &[u8], value: i64) -> Result<(), KeyTooLong> {
    let (key_len, ext) = key_len_fields(key.len())?;
    out.extend_from_slice(&key_len.to_le_bytes());
    out.extend_from_slice(&value.to_le_bytes());
    out.extend_from_slice(&ext);
    out.extend_from_slice(key);
    Ok(())
}

/// Encode tuples in the `tuples` format.
pub fn encode_tuples<'a>(tuples: impl IntoIterator<Item = (&'a [u8], i64)>) -> Result<Vec<u8>, KeyTooLong> {
    let mut out = Vec::new();
    for (k, v) in tuples {
        push_tuple(&mut out, k, v)?;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tuples_round_trip_and_truncation_is_reported() {
        let bytes = encode_tuples([(&b"ab"[..], 3), (&b""[..], -1)]).unwrap();
        // keys of 65 535 bytes and more: key_len 0xFFFF, the length after the head
        for len in [65_534usize, 65_535, 65_536, 200_000] {
            let key = vec![b'x'; len];
            let bytes = encode_tuples([(&key[..], -3), (&b"k"[..], 4)]).unwrap();
            let mut c = Cursor::new(&bytes, InputFormat::Tuples);
            assert_eq!(c.next_tuple().unwrap(), Some((&key[..], -3)), "{len}");
            assert_eq!(c.next_tuple().unwrap(), Some((&b"k"[..], 4)));
            assert_eq!(c.next_tuple().unwrap(), None);
            let cut = &bytes[..TUPLE_HEAD + 2];
            assert!(Cursor::new(cut, InputFormat::Tuples).next_tuple().is_err() || len < 65_535);
        }
        let mut c = Cursor::new(&bytes, InputFormat::Tuples);
        assert_eq!(c.next_tuple().unwrap(), Some((&b"ab"[..], 3)));
        assert_eq!(c.next_tuple().unwrap(), Some((&b""[..], -1)));
        assert_eq!(c.next_tuple().unwrap(), None);
        let cut = &bytes[..bytes.len() - 1];
        let mut c = Cursor::new(cut, InputFormat::Tuples);
        c.next_tuple().unwrap();
        assert_eq!(c.next_tuple(), Err(InputError::Truncated { offset: 12, len: 21 }));
    }

    #[test]
    fn results_round_trip_and_a_cut_record_is_reported() {
        let dir = std::env::temp_dir().join(format!("fanin-results-{}", std::process::id()));
        let entries = [
            (b"ab".to_vec(), Aggregate { sum: -7, count: 3, min: -5, max: 1 }),
            (Vec::new(), Aggregate { sum: i64::MAX, count: u64::MAX, min: i64::MIN, max: i64::MAX }),
            (vec![0xfe; 70_000], Aggregate { sum: 2, count: 2, min: 1, max: 1 }),
        ];
        write_results(&dir, entries.iter().map(|(k, a)| (k, a))).unwrap();
        let bytes = std::fs::read(&dir).unwrap();
        std::fs::remove_file(&dir).unwrap();
        let back: Vec<_> = read_results(&bytes).map(|r| r.map(|(k, a)| (k.to_vec(), a))).collect::<Result<_, _>>().unwrap();
        assert_eq!(back, entries);
        // Cut inside the second record's fixed part, then inside the first key.
        let first = RESULT_HEAD + 2;
        let got: Vec<_> = read_results(&bytes[..first + 5]).collect();
        assert_eq!(got.len(), 2);
        assert_eq!(got[1], Err(TruncatedResults { offset: first, len: first + 5 }));
        // cut inside the third record's length extension
        let third = first + RESULT_HEAD;
        let got: Vec<_> = read_results(&bytes[..third + RESULT_HEAD + 2]).collect();
        assert_eq!(got[2], Err(TruncatedResults { offset: third, len: third + RESULT_HEAD + 2 }));
        let got: Vec<_> = read_results(&bytes[..RESULT_HEAD + 1]).collect();
        assert_eq!(got, [Err(TruncatedResults { offset: 0, len: RESULT_HEAD + 1 })]);
        assert_eq!(read_results(&[]).count(), 0);
    }

    #[test]
    fn text_splits_like_python_bytes_split() {
        let text = b"  the cat\x0bsat\n\nthe\x0c end ";
        let mut c = Cursor::new(text, InputFormat::Text);
        let mut words = Vec::new();
        while let Some((w, v)) = c.next_tuple().unwrap() {
            assert_eq!(v, 1);
            words.push(w.to_vec());
        }
        assert_eq!(words, [&b"the"[..], b"cat", b"sat", b"the", b"end"]);
    }
}
