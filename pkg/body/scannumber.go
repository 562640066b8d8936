package body

// number checks -?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)? at s.i. In a body
// still arriving, a number that reaches the last byte may go on.
func (s *scanner) number() error {
	b := s.b
	i := s.i
	if i < len(b) && b[i] == '-' {
		i++
	}
	switch {
	case i >= len(b):
		return s.short()
	case b[i] == '0':
		i++
	case '1' <= b[i] && b[i] <= '9':
		i = digits(b, i)
	default:
		return s.fail("invalid character looking for a value")
	}
	var err error
	if i < len(b) && b[i] == '.' {
		if i, err = s.someDigits(i + 1); err != nil {
			return err
		}
	}
	if i < len(b) && (b[i] == 'e' || b[i] == 'E') {
		i++
		if i < len(b) && (b[i] == '+' || b[i] == '-') {
			i++
		}
		if i, err = s.someDigits(i); err != nil {
			return err
		}
	}
	if i >= len(b) && !s.final {
		return errMore
	}
	s.i = i
	return nil
}

// someDigits reads the one or more digits a fraction or an exponent needs at b[i].
func (s *scanner) someDigits(i int) (int, error) {
	switch {
	case i >= len(s.b):
		return i, s.short()
	case s.b[i] < '0' || s.b[i] > '9':
		s.i = i
		return i, s.fail("invalid number")
	}
	return digits(s.b, i), nil
}

func digits(b []byte, i int) int {
	for i < len(b) && '0' <= b[i] && b[i] <= '9' {
		i++
	}
	return i
}
