//! JSON bytes exactly as orjson 3.13 writes them (`orjson.dumps`, compact, no options
//! but `OPT_SORT_KEYS` where a caller sorts), and a reader of what it writes
//! (`orjson.loads` for the `P.state` records `refold.reduce.statecodec` reads).
//!
//! The writer's rules, each held against orjson by tests/test_native_core.py:
//! - integers in decimal; floats as the shortest digits that read back to the same
//!   float (ryu's), in fixed notation for decimal exponents -5..=15 (`1e15` is
//!   `1000000000000000.0`, `1e-5` is `0.00001`) and otherwise `d.ddde+XX` / `de-X`;
//!   an integral float keeps `.0`; `-0.0` stays `-0.0`;
//! - strings: `"` and `\` escaped, control characters below U+0020 as `\b \t \n \f \r`
//!   or `\u00xx` (lower-case hex), everything else (U+007F, U+2028, any non-ASCII)
//!   as its UTF-8 bytes.

use crate::value::Value;

/// Append the JSON string of `s` (orjson's escaping).
pub fn write_str(out: &mut Vec<u8>, s: &str) {
    let bytes = s.as_bytes();
    out.reserve(bytes.len() + 2);
    out.push(b'"');
    let mut start = 0;
    for (i, &b) in bytes.iter().enumerate() {
        let escape: &[u8] = match b {
            b'"' => b"\\\"",
            b'\\' => b"\\\\",
            0x08 => b"\\b",
            0x09 => b"\\t",
            0x0a => b"\\n",
            0x0c => b"\\f",
            0x0d => b"\\r",
            0x00..=0x1f => b"",
            _ => continue,
        };
        out.extend_from_slice(&bytes[start..i]);
        if escape.is_empty() {
            const HEX: &[u8; 16] = b"0123456789abcdef";
            out.extend_from_slice(b"\\u00");
            out.push(HEX[(b >> 4) as usize]);
            out.push(HEX[(b & 0xf) as usize]);
        } else {
            out.extend_from_slice(escape);
        }
        start = i + 1;
    }
    out.extend_from_slice(&bytes[start..]);
    out.push(b'"');
}

/// Append an integer as orjson writes a Python int.
pub fn write_int(out: &mut Vec<u8>, n: i64) {
    let mut buf = [0u8; 24];
    out.extend_from_slice(int_digits(&mut buf, n as i128));
}

/// Append a 128-bit integer (a running sum) in decimal, as `str(int)` does.
pub fn write_i128(out: &mut Vec<u8>, n: i128) {
    let mut buf = [0u8; 48];
    out.extend_from_slice(int_digits(&mut buf, n));
}

fn int_digits(buf: &mut [u8], n: i128) -> &[u8] {
    let mut i = buf.len();
    let negative = n < 0;
    let mut m = n.unsigned_abs();
    // 128-bit division is a library call: the digits past 64 bits first, then in u64
    while m > u128::from(u64::MAX) {
        i -= 1;
        buf[i] = b'0' + (m % 10) as u8;
        m /= 10;
    }
    let mut m = m as u64;
    while m >= 100 {
        let pair = (m % 100) as usize * 2;
        m /= 100;
        i -= 2;
        buf[i..i + 2].copy_from_slice(&DIGIT_PAIRS[pair..pair + 2]);
    }
    if m >= 10 {
        i -= 2;
        buf[i..i + 2].copy_from_slice(&DIGIT_PAIRS[m as usize * 2..m as usize * 2 + 2]);
    } else {
        i -= 1;
        buf[i] = b'0' + m as u8;
    }
    if negative {
        i -= 1;
        buf[i] = b'-';
    }
    &buf[i..]
}

/// "00" to "99", side by side.
const DIGIT_PAIRS: &[u8; 200] = b"0001020304050607080910111213141516171819\
2021222324252627282930313233343536373839\
4041424344454647484950515253545556575859\
6061626364656667686970717273747576777879\
8081828384858687888990919293949596979899";

/// Append a finite float as orjson 3.13 writes it (the callers refuse NaN and infinities).
pub fn write_float(out: &mut Vec<u8>, x: f64) {
    debug_assert!(x.is_finite());
    if x == 0.0 {
        out.extend_from_slice(if x.is_sign_negative() { b"-0.0" } else { b"0.0" });
        return;
    }
    // ryu's shortest round-trip digits, read back off its own text (`1.2345e-7`, `0.001`,
    // `123.0`, `1e16`): the digits without leading/trailing zeros and the decimal exponent
    let mut buffer = ryu::Buffer::new();
    let text = buffer.format_finite(x).as_bytes();
    let (negative, text) = match text.first() {
        Some(b'-') => (true, &text[1..]),
        _ => (false, text),
    };
    let (mantissa, exp_part) = match text.iter().position(|&b| b == b'e' || b == b'E') {
        Some(at) => (&text[..at], Some(&text[at + 1..])),
        None => (text, None),
    };
    let mut exp10: i32 = match exp_part {
        Some(e) => std::str::from_utf8(e).unwrap().parse().unwrap(),
        None => 0,
    };
    // digits of the mantissa and where its decimal point is
    let mut digits = [0u8; 40];
    let mut n = 0usize;
    let mut point: Option<usize> = None;
    for &b in mantissa {
        if b == b'.' {
            point = Some(n);
        } else {
            digits[n] = b;
            n += 1;
        }
    }
    let point = point.unwrap_or(n) as i32; // value = 0.digits * 10^(point + exp10)
    let lead = digits[..n].iter().take_while(|&&d| d == b'0').count();
    let mut end = n;
    while end > lead && digits[end - 1] == b'0' {
        end -= 1;
    }
    let sig = &digits[lead..end];
    // scientific exponent: value = d.ddd * 10^e
    exp10 += point - lead as i32 - 1;
    let e = exp10;
    if negative {
        out.push(b'-');
    }
    if (-5..=15).contains(&e) {
        if e >= 0 {
            let int_len = (e + 1) as usize;
            if sig.len() <= int_len {
                out.extend_from_slice(sig);
                out.resize(out.len() + int_len - sig.len(), b'0');
                out.extend_from_slice(b".0");
            } else {
                out.extend_from_slice(&sig[..int_len]);
                out.push(b'.');
                out.extend_from_slice(&sig[int_len..]);
            }
        } else {
            out.extend_from_slice(b"0.");
            out.resize(out.len() + (-e - 1) as usize, b'0');
            out.extend_from_slice(sig);
        }
    } else {
        out.push(sig[0]);
        if sig.len() > 1 {
            out.push(b'.');
            out.extend_from_slice(&sig[1..]);
        }
        out.push(b'e');
        out.push(if e > 0 { b'+' } else { b'-' });
        let mut buf = [0u8; 24];
        out.extend_from_slice(int_digits(&mut buf, e.unsigned_abs() as i128));
    }
}

// ------------------------------------------------------------------------------------
// Reading (orjson.loads of what the writer above writes)

/// Why bytes did not read as JSON, or read as a value the core does not hold.
#[derive(Debug)]
pub enum ReadError {
    /// not JSON (orjson.loads would raise JSONDecodeError)
    Invalid(String),
    /// JSON, but a value outside the core's values (an integer past 64 bits, ...)
    Unsupported(String),
}

/// Parse one JSON document (RFC 8259, as orjson.loads reads it) into a `Value`.
pub fn parse(data: &[u8]) -> Result<Value, ReadError> {
    let mut reader = Reader { data, pos: 0 };
    reader.skip_ws();
    let value = reader.value(0)?;
    reader.skip_ws();
    if reader.pos != data.len() {
        return Err(reader.invalid("trailing data"));
    }
    Ok(value)
}

struct Reader<'a> {
    data: &'a [u8],
    pos: usize,
}

impl Reader<'_> {
    fn invalid(&self, what: &str) -> ReadError {
        ReadError::Invalid(format!("{what} at byte {}", self.pos))
    }

    fn skip_ws(&mut self) {
        while let Some(&b) = self.data.get(self.pos) {
            if matches!(b, b' ' | b'\t' | b'\n' | b'\r') {
                self.pos += 1;
            } else {
                break;
            }
        }
    }

    fn literal(&mut self, word: &[u8], value: Value) -> Result<Value, ReadError> {
        if self.data[self.pos..].starts_with(word) {
            self.pos += word.len();
            Ok(value)
        } else {
            Err(self.invalid("unexpected character"))
        }
    }

    fn value(&mut self, depth: usize) -> Result<Value, ReadError> {
        if depth > 1024 {
            return Err(ReadError::Unsupported("JSON nested too deep".into()));
        }
        match self.data.get(self.pos) {
            None => Err(self.invalid("unexpected end")),
            Some(b'n') => self.literal(b"null", Value::Null),
            Some(b't') => self.literal(b"true", Value::Bool(true)),
            Some(b'f') => self.literal(b"false", Value::Bool(false)),
            Some(b'"') => Ok(Value::Str(self.string()?.into())),
            Some(b'[') => {
                self.pos += 1;
                let mut items = Vec::new();
                self.skip_ws();
                if self.data.get(self.pos) == Some(&b']') {
                    self.pos += 1;
                    return Ok(Value::List(items));
                }
                loop {
                    self.skip_ws();
                    items.push(self.value(depth + 1)?);
                    self.skip_ws();
                    match self.data.get(self.pos) {
                        Some(b',') => self.pos += 1,
                        Some(b']') => {
                            self.pos += 1;
                            return Ok(Value::List(items));
                        }
                        _ => return Err(self.invalid("expected , or ]")),
                    }
                }
            }
            Some(b'{') => {
                self.pos += 1;
                let mut entries: Vec<(Box<str>, Value)> = Vec::new();
                self.skip_ws();
                if self.data.get(self.pos) == Some(&b'}') {
                    self.pos += 1;
                    return Ok(Value::Dict(entries));
                }
                loop {
                    self.skip_ws();
                    if self.data.get(self.pos) != Some(&b'"') {
                        return Err(self.invalid("expected a string key"));
                    }
                    let name = self.string()?;
                    self.skip_ws();
                    if self.data.get(self.pos) != Some(&b':') {
                        return Err(self.invalid("expected :"));
                    }
                    self.pos += 1;
                    self.skip_ws();
                    let value = self.value(depth + 1)?;
                    // a repeated name keeps its first place and takes the last value (a dict)
                    match entries.iter_mut().find(|(n, _)| **n == *name) {
                        Some(entry) => entry.1 = value,
                        None => entries.push((name.into(), value)),
                    }
                    self.skip_ws();
                    match self.data.get(self.pos) {
                        Some(b',') => self.pos += 1,
                        Some(b'}') => {
                            self.pos += 1;
                            return Ok(Value::Dict(entries));
                        }
                        _ => return Err(self.invalid("expected , or }")),
                    }
                }
            }
            Some(b'-' | b'0'..=b'9') => self.number(),
            Some(_) => Err(self.invalid("unexpected character")),
        }
    }

    fn number(&mut self) -> Result<Value, ReadError> {
        let start = self.pos;
        let data = self.data;
        let mut at = self.pos;
        if data.get(at) == Some(&b'-') {
            at += 1;
        }
        let digits_from = at;
        while matches!(data.get(at), Some(b'0'..=b'9')) {
            at += 1;
        }
        let int_digits = at - digits_from;
        if int_digits == 0 || (int_digits > 1 && data[digits_from] == b'0') {
            self.pos = at;
            return Err(self.invalid("bad number"));
        }
        let mut float = false;
        if data.get(at) == Some(&b'.') {
            float = true;
            at += 1;
            let from = at;
            while matches!(data.get(at), Some(b'0'..=b'9')) {
                at += 1;
            }
            if at == from {
                self.pos = at;
                return Err(self.invalid("bad number"));
            }
        }
        if matches!(data.get(at), Some(b'e' | b'E')) {
            float = true;
            at += 1;
            if matches!(data.get(at), Some(b'+' | b'-')) {
                at += 1;
            }
            let from = at;
            while matches!(data.get(at), Some(b'0'..=b'9')) {
                at += 1;
            }
            if at == from {
                self.pos = at;
                return Err(self.invalid("bad number"));
            }
        }
        self.pos = at;
        let text = std::str::from_utf8(&data[start..at]).unwrap();
        if float {
            let x: f64 = text.parse().map_err(|_| self.invalid("bad number"))?;
            if !x.is_finite() {
                return Err(ReadError::Unsupported(format!("the number {text} is out of range")));
            }
            Ok(Value::Float(x))
        } else {
            text.parse::<i64>()
                .map(Value::Int)
                .map_err(|_| ReadError::Unsupported(format!("the integer {text} is past 64 bits")))
        }
    }

    fn hex4(&mut self) -> Result<u32, ReadError> {
        let Some(chunk) = self.data.get(self.pos..self.pos + 4) else {
            return Err(self.invalid("bad \\u escape"));
        };
        let text = std::str::from_utf8(chunk).map_err(|_| self.invalid("bad \\u escape"))?;
        let code = u32::from_str_radix(text, 16).map_err(|_| self.invalid("bad \\u escape"))?;
        if !chunk.iter().all(|b| b.is_ascii_hexdigit()) {
            return Err(self.invalid("bad \\u escape"));
        }
        self.pos += 4;
        Ok(code)
    }

    /// A string at `pos` (its opening quote), unescaped.
    fn string(&mut self) -> Result<String, ReadError> {
        self.pos += 1;
        let mut out: Vec<u8> = Vec::new();
        loop {
            let start = self.pos;
            while let Some(&b) = self.data.get(self.pos) {
                if b == b'"' || b == b'\\' || b < 0x20 {
                    break;
                }
                self.pos += 1;
            }
            out.extend_from_slice(&self.data[start..self.pos]);
            match self.data.get(self.pos) {
                None => return Err(self.invalid("unterminated string")),
                Some(b'"') => {
                    self.pos += 1;
                    break;
                }
                Some(b'\\') => {
                    self.pos += 1;
                    let Some(&esc) = self.data.get(self.pos) else {
                        return Err(self.invalid("unterminated string"));
                    };
                    self.pos += 1;
                    let ch = match esc {
                        b'"' => '"',
                        b'\\' => '\\',
                        b'/' => '/',
                        b'b' => '\u{8}',
                        b'f' => '\u{c}',
                        b'n' => '\n',
                        b'r' => '\r',
                        b't' => '\t',
                        b'u' => {
                            let code = self.hex4()?;
                            let code = if (0xD800..0xDC00).contains(&code) {
                                if self.data.get(self.pos..self.pos + 2) != Some(b"\\u") {
                                    return Err(ReadError::Unsupported("a lone surrogate in a string".into()));
                                }
                                self.pos += 2;
                                let low = self.hex4()?;
                                if !(0xDC00..0xE000).contains(&low) {
                                    return Err(ReadError::Unsupported("a lone surrogate in a string".into()));
                                }
                                0x10000 + ((code - 0xD800) << 10) + (low - 0xDC00)
                            } else {
                                code
                            };
                            match char::from_u32(code) {
                                Some(c) => c,
                                None => return Err(ReadError::Unsupported("a lone surrogate in a string".into())),
                            }
                        }
                        _ => return Err(self.invalid("bad escape")),
                    };
                    let mut buf = [0u8; 4];
                    out.extend_from_slice(ch.encode_utf8(&mut buf).as_bytes());
                }
                Some(_) => return Err(self.invalid("control character in a string")),
            }
        }
        String::from_utf8(out).map_err(|_| self.invalid("not UTF-8"))
    }
}
