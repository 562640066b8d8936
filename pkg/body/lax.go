package body

import (
	"math"
	"strconv"
	"strings"
)

// The engines' request models (vLLM's and SGLang's OpenAI-compatible APIs)
// are pydantic models, which in their default, lax mode coerce a value of
// another JSON type: "n": "2" and "n": 2.0 are 2, "echo": "yes" is true.
// Routing decisions that depend on such a field read it as the engine will,
// or a client could slip past them with a value the engine takes.

// LaxInt returns key's value as pydantic reads an int: a JSON integer, a
// number with no fraction (2.0, 2e0), true and false (1 and 0), or a string
// holding an integer (laxIntString). ok is false for anything else, which
// the engine refuses.
func (o *Object) LaxInt(key string) (int64, bool) {
	raw, _ := o.Raw(key)
	return LaxInt(raw)
}

// LaxInt is Object.LaxInt of a raw JSON value (a list's element).
func LaxInt(raw []byte) (int64, bool) {
	s, quoted, ok := scalar(raw)
	switch {
	case !ok:
		return 0, false
	case quoted:
		return laxIntString(s)
	case s == "true":
		return 1, true
	case s == "false":
		return 0, true
	}
	if n, err := strconv.ParseInt(s, 10, 64); err == nil {
		return n, true
	}
	f, err := strconv.ParseFloat(s, 64)
	if err != nil || f != math.Trunc(f) || math.Abs(f) >= 1<<63 {
		return 0, false
	}
	return int64(f), true
}

// laxIntString reads a string as pydantic's lax int does: spaces around it,
// a sign, decimal digits with single underscores between them (as Python's
// int()), and a fraction only of zeros ("2.0", but not "2.", ".0", "2e0" or
// "2.0000000000000001", which a float would round to 2).
func laxIntString(s string) (int64, bool) {
	s = strings.TrimSpace(s)
	if whole, fraction, dot := strings.Cut(s, "."); dot {
		if fraction == "" || strings.Trim(fraction, "0") != "" {
			return 0, false
		}
		s = whole
	}
	digits := strings.TrimPrefix(strings.TrimPrefix(s, "+"), "-")
	if len(digits) == len(s)-2 || digits == "" || digits[0] == '_' || digits[len(digits)-1] == '_' || strings.Contains(digits, "__") {
		return 0, false
	}
	n, err := strconv.ParseInt(s[:len(s)-len(digits)]+strings.ReplaceAll(digits, "_", ""), 10, 64)
	return n, err == nil
}

// LaxBool returns key's value as pydantic reads a bool: true and false, the
// numbers 0 and 1, and the strings 0, 1, f, t, n, y, no, yes, off, on,
// false and true in any case. ok is false for anything else.
func (o *Object) LaxBool(key string) (value, ok bool) {
	raw, _ := o.Raw(key)
	return LaxBool(raw)
}

// LaxBool is Object.LaxBool of a raw JSON value (a list's element).
func LaxBool(raw []byte) (value, ok bool) {
	s, quoted, ok := scalar(raw)
	if !ok {
		return false, false
	}
	if quoted {
		switch strings.ToLower(s) {
		case "1", "t", "y", "yes", "on", "true":
			return true, true
		case "0", "f", "n", "no", "off", "false":
			return false, true
		}
		return false, false
	}
	switch s {
	case "true":
		return true, true
	case "false":
		return false, true
	}
	switch f, err := strconv.ParseFloat(s, 64); {
	case err == nil && f == 1:
		return true, true
	case err == nil && f == 0:
		return false, true
	}
	return false, false
}

// scalar is a raw JSON value as text: a string's decoded contents (quoted),
// or the JSON of anything else; ok is false for no value.
func scalar(raw []byte) (s string, quoted, ok bool) {
	if len(raw) == 0 {
		return "", false, false
	}
	if raw[0] == '"' {
		s, err := decodeString(raw)
		return s, true, err == nil
	}
	return string(raw), false, true
}
